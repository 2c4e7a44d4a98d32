"""Many images: inputs, batches, background writes, manifests, resume and torchrun."""
