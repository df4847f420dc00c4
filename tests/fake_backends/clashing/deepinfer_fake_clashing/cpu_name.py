"""cpu: a backend whose entry-point name is 'cpu', reserved for the reference backend (its import fails, too)."""

raise ImportError("the fake 'cpu' backend cannot even be imported")
