"""Admission (in-flight bounds, per-tenant rate limits) and API keys: pure cores, no clock."""

from __future__ import annotations

import pytest

from pdserve.router.admission import Admission, AdmissionConfig, Overloaded
from pdserve.security.tenants import ApiKeys, AuthError, KeyFileError


def test_in_flight_bound_refuses_with_a_retry_hint_and_frees_on_release():
    a = Admission(AdmissionConfig(max_in_flight=2, busy_retry_after_s=2.0))
    a.admit("t", 0.0)
    a.admit("u", 0.0)
    with pytest.raises(Overloaded) as e:
        a.admit("v", 0.0)
    assert e.value.retry_after_s == 2.0 and "retry after 2s" in str(e.value)
    a.release("t")
    a.admit("v", 0.0)
    assert a.in_flight == 2 and a.rejected == 1


def test_per_tenant_bound_leaves_other_tenants_alone():
    a = Admission(AdmissionConfig(max_in_flight=10, max_in_flight_per_tenant=1))
    a.admit("t", 0.0)
    with pytest.raises(Overloaded, match="tenant 't'"):
        a.admit("t", 0.0)
    a.admit("u", 0.0)


def test_token_bucket_rate_limit_refills_with_time():
    a = Admission(AdmissionConfig(tenant_rate_rps=2.0, tenant_burst=2))
    a.admit("t", 0.0)
    a.admit("t", 0.0)  # the burst
    with pytest.raises(Overloaded) as e:
        a.admit("t", 0.0)
    assert e.value.retry_after_s == pytest.approx(0.5)
    a.admit("u", 0.0)  # another tenant has its own bucket
    a.admit("t", 0.5)  # half a second later: one token back
    with pytest.raises(Overloaded):
        a.admit("t", 0.6)


def test_bad_admission_config_is_refused():
    with pytest.raises(ValueError, match="max_in_flight"):
        AdmissionConfig(max_in_flight=0)
    with pytest.raises(ValueError, match="tenant_burst"):
        AdmissionConfig(tenant_burst=0)


def test_api_keys_from_a_file_and_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# key tenant\nsk-alice-0001 alice\n\nsk-bob-00002 bob  # comment\n")
    keys = ApiKeys.load(str(f), env="sk-carol-003:carol")
    assert keys.required
    assert keys.tenant_of("Bearer sk-alice-0001") == "alice"
    assert keys.tenant_of("bearer sk-carol-003") == "carol"
    assert keys.tenant_of("Bearer sk-bob-00002", cache_salt="x") == "bob:x"
    for bad in (None, "", "Bearer", "Basic sk-alice-0001", "Bearer nope-nope-nope"):
        with pytest.raises(AuthError):
            keys.tenant_of(bad)


def test_without_keys_every_request_is_the_default_tenant_unless_it_salts():
    keys = ApiKeys.load(None, env="")
    assert not keys.required
    assert keys.tenant_of(None) == "" and keys.tenant_of("Bearer whatever") == ""
    assert keys.tenant_of(None, cache_salt="s1") == "salt:s1"


def test_malformed_key_files_name_the_line(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-alice-0001 alice\nonlyonefield\n")
    with pytest.raises(KeyFileError, match="keys:2"):
        ApiKeys.load(str(f), env="")
    with pytest.raises(KeyFileError, match="at least 8"):
        ApiKeys.load(None, env="short:alice")
    with pytest.raises(KeyFileError, match="tenant must match"):
        ApiKeys.load(None, env="sk-long-enough:bad tenant!")
