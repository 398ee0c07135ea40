"""Who may enter a route, see a model and read a job."""

from __future__ import annotations

from ember.core.access import Access, Principal, may_enter, may_see, owns_job

USER, ADMIN = Principal("acme", "user"), Principal("acme", "admin")


def test_admin_routes_need_an_admin_and_authentication_off_lets_everyone_in() -> None:
    assert may_enter(USER, Access.USER) and not may_enter(USER, Access.ADMIN)
    assert may_enter(ADMIN, Access.ADMIN) and may_enter(None, Access.ADMIN)


def test_users_see_their_tenants_models_and_public_ones_admins_see_all() -> None:
    assert may_see(USER, None) and may_see(USER, "acme") and not may_see(USER, "other")
    assert not may_see(USER, "")  # an unknown owner (a contract that failed to load): admins only
    assert may_see(ADMIN, "other") and may_see(None, "other")


def test_a_job_is_its_tenants_whatever_the_role() -> None:
    assert owns_job(USER, "acme") and not owns_job(USER, "other") and not owns_job(ADMIN, "other")
    assert not owns_job(USER, None) and owns_job(None, "other")
