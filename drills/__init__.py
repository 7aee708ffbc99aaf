"""kvdrill: fault-injection drills for LLM serving stacks that share KV cache."""


def discover(discover_system: bool = True):
    """Chaos Toolkit's entry into an extension (``chaos discover kvdrill``): chaoslib imports a package's
    top-level module and calls this. The extension itself is ``drills.ctk``."""
    from drills.ctk import discover as ctk_discover

    return ctk_discover(discover_system)
