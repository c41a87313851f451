"""ZeRO-3 parameter semantics shared by the kernel and the partitioners.

Released parameters and their trap (`released`), writes to gathered or whole
parameters folded into the masters (`param_writes`), values a meta-device
initialiser left unset (`unset`), the map from parameters to group elements
(`param_map`), which modules are units (`unit_modules`, `module_select`).
"""
