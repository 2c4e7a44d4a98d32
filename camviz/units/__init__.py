"""What a unit sees: top-activating examples, receptive fields and feature visualisation."""
