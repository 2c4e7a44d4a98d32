"""CAM methods, one short module each, found by name in one registry.

>>> camviz.cams.names()
['gradcam', ...]
>>> camviz.cams.get("gradcam")
<class 'camviz.cams.gradcam.GradCAM'>
"""

from camviz.cams import (  # noqa: F401 - importing a method module registers it
    ablationcam,
    attentionrollout,
    cam,
    eigencam,
    fem,
    fullgrad,
    gradcam,
    gradcampp,
    gradientrollout,
    guided,
    hirescam,
    kpcacam,
    layercam,
    legrad,
    randomcam,
    scorecam,
    segeigencam,
    sess,
    shapleycam,
    transformerattribution,
    wrappers,
    xgradcam,
)
from camviz.cams.base import CamMethod, ChannelMapMethod, LayerData
from camviz.cams.engine import Explanation, explain, layer_pass
from camviz.cams.registry import create, get, names, register, table

__all__ = [
    "CamMethod",
    "ChannelMapMethod",
    "Explanation",
    "LayerData",
    "create",
    "explain",
    "get",
    "layer_pass",
    "names",
    "register",
    "table",
]
