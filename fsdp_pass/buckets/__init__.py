"""Buckets: the DBuffer behind each bucket (``dbuffer``) and what is per bucket: its mesh (``mesh``), the
graph op that gathers it and reduces its gradient (``gather``, ``matmul_into``), its whole parameters for
eager calls (``whole_values``), never-initialized parameters (``uninitialized``), user settings
(``settings``, ``gradient_sync``) and optimizer list kernels over its flat views (``list_kernels``)."""
