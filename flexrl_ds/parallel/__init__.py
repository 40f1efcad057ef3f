"""Devices, backends and process groups (the only package that names cuda/nccl vs cpu/gloo)."""
