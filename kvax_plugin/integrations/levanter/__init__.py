"""attn_backend=kvax for Levanter (PyPI marin-levanter + marin-haliax).

    from kvax_plugin.integrations import levanter as kvax_levanter
    kvax_levanter.install()     # then any Levanter model config takes attn_backend: kvax
    kvax_levanter.configure(kernel="triton")   # optional: kernel, block size (settings.py)

install() is idempotent, version-guarded and reversible (uninstall()); Levanter's source is
untouched (_install.py lists what is wrapped).
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
