"""Every suite of this repository (the library's, the pipeline's, the example's, the
template's) gets the test kit's real-server fixtures: Redis, PostgreSQL, Tansu, unique names.

Declared here, at the root, because pytest accepts ``pytest_plugins`` only in a conftest it
loads before collecting; the example's tests/conftest.py declares it again for a generated
service, where tests/ is the root of the suite.
"""

pytest_plugins = ["reliable_consumer.testing.fixtures"]
