"""fakeimporterror: its vendor SDK is missing, so importing the backend module fails."""

raise ImportError("No module named 'fake_vendor_sdk' (deliberate: deepinfer test fake)")
