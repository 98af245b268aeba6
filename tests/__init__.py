"""graphfl.tests"""
