"""Text: tokens to text and back, and the prompts the chat templates make.

- ``tokenizer.py``: the GGUF's tokenizer (through transformers' GGUF conversion) and a streaming decoder.
- ``tokenizer_meta.py``: a byte-level BPE tokenizer written into a GGUF as llama.cpp's converter does;
  ``vocab.py``: the tokenizer metadata of a GGUF checked.
- ``chat.py``: the model's jinja2 chat template.
- ``harmony.py``: gpt-oss's harmony format split into reasoning and content.
"""
