from django.urls import path

from controlplane.dashboard import views

urlpatterns = [
    path("", views.index, name="dashboard"),
    path("assets/<path:path>", views.asset, name="dashboard-asset"),
]
