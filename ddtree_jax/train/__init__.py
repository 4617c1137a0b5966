"""Training: the demo corpus and tokenizer, target pretraining, and DFlash drafter training.

- `corpus`:    the Python standard library's own .py files, split by file into train and held out.
- `tokenizer`: a byte-level BPE trained on the corpus, saved so that `AutoTokenizer` loads it.
- `target`:    pretrain a small Qwen3 target (`python -m ddtree_jax.train.target`).
- `drafter`:   train a DFlash drafter for any supported target (`python -m ddtree_jax.train.drafter`).
- `demo`:      the whole pipeline in one command (`python -m ddtree_jax.train.demo`).
- `common`:    what the two trainers share: learning-rate schedule, optimizer, orbax train state,
               JSON log and loss curve.
"""
