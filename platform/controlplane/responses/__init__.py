"""Stored responses of OpenAI's Responses API, which the gateway serves: kept here, per organization, until
they expire, with the token ids of their conversations."""
