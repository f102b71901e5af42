"""The Megatron-core trainer backend (train=megatron): trainer, HF conversion, CPU layer."""
