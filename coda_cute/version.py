"""The package's version, printed in every emitted kernel's header and by ``coda-cute --version``.

Its own module, below every stage, so that ``render`` can print it without importing the
package's ``__init__`` (which exposes the runtime); ``pyproject.toml`` reads it from here.
"""

__version__ = "0.1.0"
