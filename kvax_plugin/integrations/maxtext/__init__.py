"""attention=kvax for MaxText.

    from kvax_plugin.integrations import maxtext as kvax_maxtext
    kvax_maxtext.install()          # then run MaxText with attention=kvax (and kvax_* keys)

or, without install(), apply patches/maxtext/<version>/ to MaxText's source. The command line
`python -m kvax_plugin.integrations.maxtext.train <MaxText train args> attention=kvax` runs
MaxText's own training entry point with the plugin installed.
"""

from kvax_plugin.integrations.maxtext import mesh_rules
from kvax_plugin.integrations.maxtext._install import install, is_installed, is_patched, uninstall
from kvax_plugin.integrations.maxtext.seam import ATTENTION_NAME
from kvax_plugin.integrations.maxtext.settings import (KVAX_CONFIG_FIELDS, kvax_config_class,
                                                       options_from_config)
from kvax_plugin.integrations.maxtext.versions import (SUPPORTED_MAXTEXT_VERSIONS,
                                                       MaxTextVersionError)

__all__ = ["mesh_rules", "install", "uninstall", "is_installed", "is_patched", "ATTENTION_NAME",
           "KVAX_CONFIG_FIELDS", "kvax_config_class", "options_from_config",
           "SUPPORTED_MAXTEXT_VERSIONS", "MaxTextVersionError"]
