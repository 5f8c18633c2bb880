"""torch.cuda of the metadata-only torch: there is no accelerator."""

import kvtier_placeholders as _placeholders


def is_available() -> bool:
    return False


def device_count() -> int:
    return 0


def __getattr__(name):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return _placeholders.Placeholder(f"torch.cuda.{name}")
