"""The model split over devices: each collective a named region (regions.py), the
tensor-parallel block composed of them (tensor.py). The hand-derived backward of each is
manual_grads/parallel/."""
