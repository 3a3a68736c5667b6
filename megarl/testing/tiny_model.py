"""Former home of the ``tiny:`` model builder, now :mod:`megarl.models.tiny` (a product feature, not
a test helper). This name stays importable: it *is* that module (same object, same attributes), so
existing imports and monkeypatches keep working."""
import sys

from megarl.models import tiny as _tiny

sys.modules[__name__] = _tiny
