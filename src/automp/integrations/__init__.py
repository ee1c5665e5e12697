"""Where users already choose precision: one argument in the frameworks they train with.

transformers: `Trainer(..., callbacks=[automp.integrations.transformers.AutoMPCallback()])`. Each integration is
imported on its own (`import automp.integrations.transformers`), so this package needs none of the frameworks.
"""
