"""jaxlowbit's trainer: ``python -m train.main --config configs/tiny.py --workdir runs/tiny``.

Modules, in the order a run uses them: ``config`` (the config schema and recipe names), ``spec``
(the run resolved once into the frozen ``RunSpec`` every later module reads),
``data`` (byte tokenizer, corpora, deterministic resumable batches), ``model`` (Llama-style
decoder with jaxlowbit linears), ``optimizer``, ``runtime`` and ``steps`` (where and how a step
runs), ``checkpoint``, ``metrics``, ``run_control``, ``loop`` (the training loop, one file to
read top to bottom), ``main`` (command line) and ``plot``. After a run: ``runs`` (a run read
back), ``generate`` (text), ``hf`` (Hugging Face and GGUF files; the code in ``train/io/``).
"""
