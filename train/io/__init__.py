"""Model files in and out of ``train.model``: Hugging Face folders (safetensors) and GGUF.

``hf_config`` (config.json and the name mapping) -> ``hf_reader`` / ``hf_writer``; ``gguf_ternary``
(TQ block bytes) and ``gguf_tokenizer`` -> ``gguf`` / ``gguf_export``. The modules import only
downward, and of the trainer only ``train.model`` and ``train.data`` (tokenizers). The public names
and the command line are ``train.hf``'s.
"""
