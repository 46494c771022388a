"""Training of the fidelity model and the probes of that training (not installed).

Research code: it builds the committed models under ``models/`` from the package's
tiny-model builders and the harness's fidelity task. Run from the repository root, e.g.
``python -m training.train_fidelity_model --help``.
"""
