"""Test fakes that load: fakegood (partial, priority 50), fakeunavail, fakerequired."""
