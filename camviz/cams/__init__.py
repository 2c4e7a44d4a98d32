"""CAM methods, one short module each, found by name in one registry.

>>> camviz.cams.names()
['gradcam', ...]
>>> camviz.cams.get("gradcam")
<class 'camviz.cams.gradcam.GradCAM'>
"""

from camviz.cams import (  # noqa: F401 - importing a method module registers it
    ablationcam,
    eigencam,
    fullgrad,
    gradcam,
    gradcampp,
    guided,
    hirescam,
    layercam,
    legrad,
    scorecam,
    sess,
    wrappers,
    xgradcam,
)
from camviz.cams.base import CamMethod, LayerData
from camviz.cams.engine import Explanation, explain, layer_pass
from camviz.cams.registry import get, names, register, table

__all__ = [
    "CamMethod",
    "Explanation",
    "LayerData",
    "explain",
    "get",
    "layer_pass",
    "names",
    "register",
    "table",
]
