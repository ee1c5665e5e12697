"""Where users already choose precision: one argument in the frameworks they train with.

transformers: `Trainer(..., callbacks=[automp.integrations.transformers.AutoMPCallback()])`; Lightning:
`Trainer(plugins=[automp.integrations.lightning.AutoMP()])`, and `AutoMPFabric` for Fabric. Each integration is
imported on its own (`import automp.integrations.lightning`), so this package needs none of the frameworks.
"""
