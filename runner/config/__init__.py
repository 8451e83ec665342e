"""What a run is asked to be: the schema of the config, a plugin's options typed by its
constructor, the plugin registries and the user's code named by _target_, and what this machine
costs."""
