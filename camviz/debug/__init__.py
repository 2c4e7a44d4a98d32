"""What people use hooks for day to day: features, layer statistics, gradients, edits."""
