"""Test fakes that are broken: fakebroken_probe, fakeversion, fakebadhook, fakeimporterror, fakebadinfo,
fakedictplatform, fakebadsignature."""
