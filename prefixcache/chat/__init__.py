"""Text in and out: the byte-level tokenizer, our ChatML template (with tools), and Hugging Face tokenizers with
their own chat templates.  Depends on nothing but the errors."""
