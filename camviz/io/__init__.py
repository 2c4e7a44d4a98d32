"""Images, video frames and models in; colour maps, overlays, grids and figures out."""
