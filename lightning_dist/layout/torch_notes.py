"""Two torch warnings that ``Sharded``'s users cannot act on, silenced during each Trainer run.

- ``"Slicing a flattened dim from root mesh will be deprecated"``: ``Sharded``'s
  ``device_mesh["data_parallel"]`` is its two dimensions flattened (``ModelParallelStrategy``'s is a
  dimension of its own), so the lookup written for ``ModelParallelStrategy`` in a ``configure_model``
  slices a flattened dimension. The strategy reads the flattened mesh it keeps instead (the sampler's
  split); a user's lookup is the documented way and stays valid.
- ``"FSDP2-wrapped module (...) returned a view tensor"``: ``nn.Linear`` on a 3-D input (every
  language model's head) returns a view, and so does a model returning that output. FSDP2 warns on
  every such output, every rank, in case the caller modifies it in place (``out += y``, which would
  skip that module's all-gather in backward); docs/sharded.md says so once, under Limits.

Only these messages, and only from ``torch.distributed`` modules, from ``quiet()`` to ``restore()``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, cast

MESSAGES = (
    r"Slicing a flattened dim from root mesh will be deprecated",
    r"FSDP2-wrapped module \(.*\) returned a view tensor",
)
"""The start of each silenced warning (a regular expression, as ``warnings.filterwarnings`` takes)."""
MODULE = r"torch\.distributed\."


def quiet() -> list[Any]:
    """Silence ``MESSAGES``; returns the filters added (for ``restore``)."""
    added = []
    for message in MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=MODULE)
        added.append(warnings.filters[0])
    return added


def restore(added: list[Any]) -> None:
    """Remove the filters ``quiet`` added (those still there: a ``catch_warnings`` exit may have
    dropped them already)."""
    filters = cast(list[Any], warnings.filters)  # a list (typeshed says Sequence)
    for entry in added:
        with contextlib.suppress(ValueError):
            filters.remove(entry)
