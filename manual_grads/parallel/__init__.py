"""The backward of the model split over devices (jaxformer/model/parallel/): each region's
transpose (regions.py), the tensor-parallel block's (tensor.py), the vocab-parallel head and
loss's (vocab.py), ring attention's (ring.py) and the context-parallel blocks' (context.py)."""
