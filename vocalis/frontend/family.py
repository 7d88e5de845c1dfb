"""The request preparation of each model family, picked by the model's config: CosyVoice 2's `Frontend`, or a
family's subclass of it (CosyVoice 3: `prompt_cv3.CV3Frontend`). A new family is one entry in `FRONTENDS`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vocalis.config import CosyVoice3Config
from vocalis.frontend.prompt import Frontend
from vocalis.frontend.prompt_cv3 import CV3Frontend

if TYPE_CHECKING:
    from vocalis.model_dir import LoadedModel

# config type -> its frontend; any other config: CosyVoice 2's
FRONTENDS: dict[type, type[Frontend]] = {CosyVoice3Config: CV3Frontend}


def frontend_for(model: LoadedModel) -> Frontend:
    """The request preparation of the model's family."""
    return FRONTENDS.get(type(model.config), Frontend)(model)
