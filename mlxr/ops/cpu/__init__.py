"""mlxr's own compiled CPU kernels (kernels.c, built at install time when a C compiler is there)
and their plain-torch twins: `native` loads the extension and wraps its calls in typed functions
over torch tensors; `twins` computes the same results with torch ops (the fallback and the tests'
oracle)."""
