"""attn_backend=kvax for Levanter (PyPI marin-levanter + marin-haliax).

    from kvax_plugin.integrations import levanter as kvax_levanter
    kvax_levanter.install()     # then any Levanter model config takes attn_backend: kvax
    kvax_levanter.configure(kernel="triton")   # optional: kernel, block size (settings.py)

or run Levanter's training entry point with the plugin installed:

    python -m kvax_plugin.integrations.levanter.train_lm --config_path ... --model.attn_backend kvax

install() is idempotent, version-guarded (SUPPORTED_LEVANTER_VERSIONS) and reversible
(uninstall()). Levanter's own source is untouched: see _install.py for what is wrapped.
"""

from kvax_plugin.integrations.levanter._install import (DECODER_ENTRIES, install, is_installed,
                                                        uninstall)
from kvax_plugin.integrations.levanter.seam import ATTENTION_BACKEND_NAME
from kvax_plugin.integrations.levanter.settings import KvaxLevanterSettings, configure, current
from kvax_plugin.integrations.levanter.versions import (SUPPORTED_LEVANTER_VERSIONS,
                                                        LevanterVersionError)

__all__ = ["install", "uninstall", "is_installed", "DECODER_ENTRIES", "ATTENTION_BACKEND_NAME",
           "KvaxLevanterSettings", "configure", "current", "SUPPORTED_LEVANTER_VERSIONS",
           "LevanterVersionError"]
