"""What the command line says as a run trains, beside blujax.metrics (metrics.jsonl, the loss
plot, the progress display, throughput and MFU): warnings, and the plot's title.
"""

from __future__ import annotations

import sys

from blujax import model


def warn(text: str):
    """A warning line, on stderr, at once."""
    print(text, file=sys.stderr, flush=True)


def plot_title(s, model_config) -> str:
    return (f"{model.family_of(model_config).TITLE} {s.model} ({model_config.n_layer} layers, {model_config.n_embd} wide), "
            f"{s.batch}x{s.seq} tokens/step, lr {s.lr:g}")
