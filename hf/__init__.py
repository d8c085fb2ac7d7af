"""Everything Hugging Face: the exporter (`hf.export`), the import of a local model directory into
our model (`hf.imports`: GPT-NeoX / Pythia, Llama, our own exports), our parameters under their
Hugging Face names (`hf.names`, by `model.hf_layout`) and the thin remote-code wrapper an export
ships (`modeling_coca_lm.py`, copied into exports beside the files of `model/` it imports with one
dot, our decoder among them; it is not a module of this package).

Below train in the import graph: it never reads a run's checkpoint (that is `train.load`), so train
can build on it (the exporter's command line, `init_from=<Hugging Face directory>`).
"""
