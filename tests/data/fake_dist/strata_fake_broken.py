"""A plugin that fails to import: the manager must log it and carry on."""

raise ImportError("this plugin is broken on purpose")
