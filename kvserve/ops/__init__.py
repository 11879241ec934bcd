"""The kernels' floor: the C/OpenMP kernels of ``kvserve/csrc/`` as thin Python faces.

``library`` builds and loads the shared libraries (one per kernel family) and holds the one
call helper; ``cpu`` says what the host CPU can run. Each other module is the face of one
family: it packs weights where the family needs a layout of its own, checks shapes and dtypes,
allocates the output and calls the symbol. Nothing here imports kvserve above ``envs``; the
choice of kernel per weight is the model executor's (``model_executor/layers/linear.py``).
"""
