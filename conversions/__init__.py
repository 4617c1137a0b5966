"""Weight conversion scripts (Hugging Face safetensors <-> orbax)."""
