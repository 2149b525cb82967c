"""Development tools: the embedded broker and Redis, the demo, sample data, the handler scaffold.

Updated from the template; nothing here runs in production. Standard library only at import
time: the template's post-generation hook imports ``reliable_consumer.dev.scaffold`` without the
project's dependencies installed.
"""
