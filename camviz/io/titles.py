"""Titles of pictures drawn word by word, each word's pixels rendered once.

Pillow renders every glyph of a text anew each time it is drawn; a panel's title took a
third of the panel's drawing that way, and most of its words recur from one picture to the
next (the class names, the method, the layer). So each word is rendered once into its
coverage mask, kept (the most recent few thousand), and pasted through it in black.
Words are set one space apart, as Pillow sets them, the line centred.
"""

from __future__ import annotations

import functools
import threading

from PIL import Image, ImageDraw, ImageFont

# Words whose masks are kept (a few hundred bytes each).
_KEPT_WORDS = 4096

# One font object serves every writer thread; FreeType's faces are not thread-safe, so a
# word is rendered (when it is not kept yet) under this lock.
_RENDERING = threading.Lock()


def draw_title(canvas: Image.Image, title: str, top: int, size: int) -> None:
    """``title`` in black in Pillow's default font of ``size``, centred on ``canvas`` with
    its ascender line at ``top``; nothing for an empty title."""
    if not title:
        return
    words = title.split(" ")
    space = _word(" ", size)[1]
    length = sum(_word(word, size)[1] for word in words) + space * (len(words) - 1)
    left = canvas.width / 2 - length / 2
    for word in words:
        mask, advance, corner = _word(word, size)
        if mask is not None:
            canvas.paste("black", (round(left) + corner[0], top + corner[1]), mask)
        left += advance + space


@functools.cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's default font of ``size`` (made from its bytes on each call of Pillow's)."""
    return ImageFont.load_default(size)


@functools.lru_cache(maxsize=_KEPT_WORDS)
def _word(word: str, size: int) -> tuple[Image.Image | None, float, tuple[int, int]]:
    """One word: its glyphs' coverage (``None`` when it has none), its advance, and where
    the coverage starts from the pen at the ascender line."""
    font = _font(size)
    with _RENDERING:
        advance = font.getlength(word)
        left, top, right, bottom = (int(edge) for edge in font.getbbox(word, anchor="la"))
        if right <= left or bottom <= top:
            return None, advance, (0, 0)
        mask = Image.new("L", (right - left, bottom - top), 0)
        ImageDraw.Draw(mask).text((-left, -top), word, fill=255, font=font, anchor="la")
    return mask, advance, (left, top)
