"""Per-layer layouts on the `Pr × Pc` grid (`strategy=auto`): the layouts of activations and of a
layer (`layer`), and a chain of layers each in its own layout (`chain`).
"""
