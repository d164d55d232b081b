"""The backward of the model split over devices (jaxformer/model/parallel/): each region's
transpose (regions.py) and the tensor-parallel block's (tensor.py)."""
