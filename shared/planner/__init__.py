"""Planning a fleet: profiles (measured by `baton profile`), the simulator and `baton plan`."""
