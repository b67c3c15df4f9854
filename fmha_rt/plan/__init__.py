"""Planning, pure data: an attention call (problem.py) mapped onto kernel launches.

abi.py (the kernels' signatures, tiles and variant form), layout.py (scratch and workspace regions,
padded tensors), args.py (one launch and its arguments), backward.py (the backward's passes) and
head_padding.py (the padding copies) are shared; each kernel family (portable.py, v3.py) composes them,
and dispatch.py chooses the family of a call.
"""
