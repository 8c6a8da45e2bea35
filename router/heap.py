"""Keep the collector's full passes off the router's event loop: freeze what loading left.

Loading a model's tokenizer through ``transformers`` imports it and torch: the router's heap
goes from about 77,000 objects the collector tracks to about 398,000, all of them alive for
the process's life. CPython's oldest generation is collected whenever enough objects survived
into it, and each such pass walks every tracked object with the event loop held: 360 ms for
that heap on this box, measured alone, and one pass took 539 ms under load at 600 req/s (every
stream the router relayed stood still meanwhile: the requests it held made that run's whole
p99, about 1.1 s). :func:`settle` moves everything allocated so far into
the permanent generation (:func:`gc.freeze`), which no pass walks; what requests allocate
afterwards is collected as before.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def settle() -> int:
    """Freeze every object the collector tracks now (imports, tokenizers, start-up state) so
    later full collections skip them; returns how many objects are frozen in all."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("heap settled: %d objects frozen", frozen)
    return frozen
