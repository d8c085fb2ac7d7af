"""Everything Hugging Face: the exporter (`hf.export`), the import of a local model directory into
our model (`hf.imports`: GPT-NeoX / Pythia, Llama, our own exports), the one parameter-name map
(`hf.names`) and the remote-code model an export ships (`modeling_coca_lm.py`, a file copied into
exports beside the files of `model/designs/`, which it imports with one dot; it is not a module of
this package).

Below train in the import graph: it never reads a run's checkpoint (that is `train.load`), so train
can build on it (the exporter's command line, `init_from=<Hugging Face directory>`).
"""
