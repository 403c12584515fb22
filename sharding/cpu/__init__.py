"""The compiled CPU kernels: which build runs (variants), the ops (kernels), huge pages."""
