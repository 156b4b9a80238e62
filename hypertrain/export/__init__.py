"""`python -m hypertrain.export RUN_DIR [--checkpoint PATH] --out DIR`: a run's global weights as a Hugging
Face model directory (`save_pretrained`) that `AutoModelForCausalLM.from_pretrained` reads, with the run's
tokenizer where its data has one (docs/export.md). `names` maps an own model to its Hugging Face
architecture; `command` is the command.
"""
