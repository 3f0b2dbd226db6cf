"""jaxlowbit's trainer: ``python -m train.main --config configs/tiny.py --workdir runs/tiny``.

Modules, in the order a run uses them: ``config`` (the config schema and recipe names),
``data`` (byte tokenizer, corpora, deterministic resumable batches), ``model`` (Llama-style
decoder with jaxlowbit linears), ``optimizer``, ``checkpoint``, ``metrics``, ``loop`` (the
training loop, one file to read top to bottom), ``main`` (command line) and ``plot``.
"""
